"""Step credit from screen states: which step of a long GUI episode earned the reward.

GiGPO's anchor states without a critic (docs/credit.md): the steps of a task's group that start
from one state form a step group, and each step's discounted return minus its step group's mean
is added to the advantage of its tokens. ``keys``: a step's state key (the gym's, a perceptual
hash of its screenshot, or the strict sha256); ``steps``: an episode's steps and their token
spans; ``advantages``: step groups, step advantages, false merges, the per-token tensor;
``ledger`` and ``observer``: the rollout worker's step data from an episode's end to its group's
filter; ``trainer``: the actor's side; ``config``: the ``step_credit`` section.

Nothing is imported here: the rollout worker, the group filter and the actor each import only
the module they use.
"""
