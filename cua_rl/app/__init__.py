"""The application: the training launcher and what a person runs around it.

- ``train``: ``python -m examples.cua_agent.train`` (the example's ``train.py`` calls ``main``):
  config, task selection, monitor records, baseline, ``PPOTrainer.train``, the end of the run.
- ``config``: ``CUAConfig(GRPOConfig)`` with one section per concern, validated at load.
- ``failfast``: stops a training in which one reason rejected every episode for a while.
- ``demo`` / ``progress``: ``make demo`` and its terminal; ``learn`` / ``learning``: ``make learn``
  and its curves; ``controls``: the negative-control workflows.
"""
