"""Train a GUI agent with AReaL's PPOTrainer.

    .venv/bin/python -m examples.cua_agent.train --config configs/cua.yaml [--check] [key=value ...]

The launcher (``cua_rl.app.train``) loads the config (``cua_rl.app.config_load``: a YAML plus
``key=value`` overrides), selects the tasks into train and eval datasets, opens the run's monitor
records, runs a baseline evaluation, then ``PPOTrainer.train`` with the workflow the config names
(``workflow:``, by default this folder's ``CUAAgentWorkflow``) and the complete-group filter. The
training record ends completed, or failed with the error (cancelled on Ctrl-C or SIGTERM).
``--check`` validates the config and reaches every service without training.
"""

import sys

from cua_rl.app.usage import exit_if_arguments_wrong

if __name__ == "__main__":
    # Before the launcher's imports (AReaL, torch): --help, a missing config file or a bad
    # option answer at once.
    exit_if_arguments_wrong(sys.argv[1:])
    # Where a process that runs many trainings keeps these imports in a zygote (the test suite:
    # CUA_RL_TRAINER_ZYGOTE), this process stands in for a fork of it.
    from cua_rl.cpu.warm_start import ENV_TRAINER_ZYGOTE, hand_over

    hand_over(ENV_TRAINER_ZYGOTE, "trainer")
    from cua_rl.app.train import cli

    cli()
