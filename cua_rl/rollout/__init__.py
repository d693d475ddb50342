"""The rollout: one episode of a GUI agent on a gym box, turned into training rows.

- ``workflow``: ``CUAAgentWorkflow``, AReaL's ``RolloutWorkflow`` for one episode; its hooks are
  the episode's stages (run spec, agent run, reward, rows) and its observers' list.
- ``episode``: the pipeline, its typed stages, the events it emits and ``EpisodeObserver``.
- ``observers``: who observes an episode (``observers_of``), isolated; the step's stats.
- ``runtime``: what a worker's episodes share (one per engine; a scope per event loop and one per
  episode); ``settings``: what a rollout worker is given (``WorkflowSettings`` and its sections).
- ``service_pauses``, ``drain``: new episodes wait while a service fails; the run's end.
- ``placement``: which monitor record an episode belongs to; ``groups``: the complete-group
  filter; ``outcomes``: each worker's outcome file for the failfast watch.

Nothing is imported here, so importing a light module (``groups``) does not pull in AReaL.
"""
