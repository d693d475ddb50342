"""The production integration with AReaL: what runs on a GPU cluster as it runs here.

- ``logits`` / ``logits_engine``: selective logits, the actor computing full-vocabulary logits
  only where the loss reads them (docs/logits.md).
- ``ports``: AReaL's free-port draw made independent of the training seed.
- ``hooks``: ``TrainerHooks``, the monitor's hooks on the trainer's step phases and evals.
- ``curriculum_trainer``: ``PPOTrainer`` with the curriculum as its train sampler.
- ``support``: the AReaL release supported and every AReaL internal relied on (overridden,
  wrapped, replaced), with ``check_areal``, which the launcher runs before training.

Apart from this package, ``cua_rl.cpu`` is the harness that lets AReaL run without a GPU.
"""
