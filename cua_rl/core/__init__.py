"""What several packages share, written once.

- ``reasons``: the rejection reasons, a documented ``StrEnum`` (docs/rejections.md).
- ``images``: image data URLs, type sniffing and the image URL policy (allowed hosts, sizes)
  that the trajectory converter, the gateway and the monitor's screenshots apply alike.
- ``row``: the training row's contract (keys, dtypes, shapes) and its validator.
- ``spill``: byte strings a service keeps serving, held in unnamed files instead of its memory
  (the local gym's retained screenshots, the local agent's finished runs).
- ``fields``: ``doc(default, help)``, a config dataclass field with its help text (the
  ``metadata={"help": ...}`` AReaL's config classes use).

Nothing here imports AReaL, vLLM or another ``cua_rl`` package but ``cua_rl.errors``.
"""
