"""The monitor's worker side: what training processes use to record into a Training Monitor.

- ``client``: the non-blocking, batching, spooling HTTP client; it never raises into training
  (``settings``: its config; ``spool``: its spool file).
- ``uploader``: screenshots prepared once (downscaled WebP, by hash) and uploaded in the background.
- ``context`` / ``recorder``: the current training/step/eval/baseline, and one rollout's records.
- ``training``: the training's own records (training, steps, baseline, evals) behind a
  synchronous facade for the launcher.
"""
