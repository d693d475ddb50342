"""The rollout: one episode of a GUI agent on a gym box, turned into one training row.

- ``workflow``: ``CUAAgentWorkflow``, AReaL's ``RolloutWorkflow`` for one episode; it orchestrates
  the service clients and calls pure functions (``cua_rl.trajectory``, ``cua_rl.reward``).
- ``settings``: what a rollout worker is given (``WorkflowSettings`` and its sections).
- ``episode``: what one episode produced and its stats; ``services``: its clients per event loop;
  ``placement``: which monitor record an episode belongs to; ``groups``: the complete-group
  filter; ``outcomes``: each worker's outcome file for the failfast watch.

Nothing is imported here, so importing a light module (``groups``) does not pull in AReaL.
"""
