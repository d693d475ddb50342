"""``CurriculumPPOTrainer``: AReaL's ``PPOTrainer`` with the curriculum as its train sampler.

The hook is the least invasive one AReaL 1.0.4 offers. ``PPOTrainer.__init__`` builds its train
loader through one method, ``_create_dataloader``, and then loads a recover checkpoint into that
loader; the training loop, the controller's ``prepare_batch`` (which pulls rows from the loader
whenever there is room for more rollouts) and the checkpointing are unchanged. Overriding that
method to put a ``CurriculumSampler`` in the train ``StatefulDataLoader`` therefore makes every
task the controller submits come from the selector, and the sampler's state ride in the recover
checkpoint. The valid loader is AReaL's own.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from areal import PPOTrainer
from torchdata.stateful_dataloader import StatefulDataLoader

from cua_rl.curriculum.outcomes import MonitorOutcomes
from cua_rl.curriculum.sampler import CurriculumSampler
from cua_rl.curriculum.selector import CurriculumConfig
from cua_rl.errors import ConfigError

DECISION_LOG = "curriculum.jsonl"


def make_sampler(
    config: CurriculumConfig,
    task_ids: list[str],
    *,
    monitor_url: str,
    run_name: str,
    monitor_token: str | None,
    batch_size: int,
    group_size: int,
    seed: int,
    drop_last: bool,
    log_dir: str | Path | None,
) -> CurriculumSampler:
    if not monitor_url:
        raise ConfigError(
            "curriculum.kind=ucb reads task outcomes from the Training Monitor, and this run "
            "has none: set monitor.enabled=true with monitor.db_path or monitor.base_url"
        )
    source = MonitorOutcomes(
        monitor_url, run_name, token=monitor_token, timeout_s=config.fetch_timeout_s
    )
    return CurriculumSampler(
        task_ids,
        config=config,
        source=source,
        batch_size=batch_size,
        group_size=group_size,
        seed=config.seed if config.seed is not None else seed,
        drop_last=drop_last,
        log_path=Path(log_dir) / DECISION_LOG if log_dir else None,
    )


class CurriculumPPOTrainer(PPOTrainer):
    """``PPOTrainer(config, train_dataset, valid_dataset, sampler=...)``."""

    def __init__(self, config: Any, train_dataset=None, valid_dataset=None, *, sampler):
        # Set before super().__init__, which builds the loaders and loads the recover state.
        self.curriculum_sampler: CurriculumSampler = sampler
        super().__init__(config, train_dataset=train_dataset, valid_dataset=valid_dataset)

    def _create_dataloader(self, dataset, dataset_config, rank: int, world_size: int):
        if dataset_config is not self.config.train_dataset:
            return super()._create_dataloader(dataset, dataset_config, rank, world_size)
        if world_size != 1:
            raise ConfigError(
                f"the curriculum draws for one data loader (AReaL's single controller); this "
                f"trainer builds {world_size}: run in single-controller mode or set "
                "curriculum.kind=uniform"
            )
        if len(dataset) != len(self.curriculum_sampler.task_ids):
            raise ConfigError(
                f"the curriculum was built for {len(self.curriculum_sampler.task_ids)} train "
                f"tasks and the train dataset has {len(dataset)}"
            )
        # No loader workers: they would prefetch batches, drawn before the outcomes they wait for.
        return StatefulDataLoader(
            dataset,
            batch_size=dataset_config.batch_size,
            sampler=self.curriculum_sampler,
            drop_last=dataset_config.drop_last,
            num_workers=0,
            collate_fn=lambda rows: rows,
        )
