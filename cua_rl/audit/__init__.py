"""The verifier audit: does a task's verifier reward what the task asks, and only that?

Before a verifier trains a policy, ``python -m cua_rl.audit --config FILE.yaml`` (the training's
own config) runs scripted agents that need no model on fresh boxes of every task: stop at once,
look at the screen then stop, random actions, claim the task infeasible, and replays of known
successes (the warehouse's recorded ones, a task's own solution) with and without each of their
state-changing actions. Each action sequence runs several times. A task whose verifier rewards
doing nothing is flagged *free reward*, one that rejects a replayed success *rejects its own
success*, one whose rewards differ for one action sequence *flaky*. The verdicts, with their
evidence, are printed, written as JSON, recorded in the monitor (``/audits``) and read by a
training that leaves out flagged tasks (``curriculum.skip_flagged``). Training counts, per step,
rewarded episodes in which no action changed the state (``cua_rl.audit.live``). docs/audit.md.

Modules: ``state`` (did an action change the state: the definition shared with training),
``plans`` (the scripted agents), ``runner`` (a plan on a box), ``verdict`` (runs -> flags),
``session`` (one audit), ``report`` (the terminal and the JSON), ``record`` (the monitor),
``flagged`` (training leaves flagged tasks out), ``live`` (the training's free-reward count),
``cli``.
"""
