"""Role workers: the Ray-actor classes a recipe puts in its worker groups.

* `ActorWorker` -- the policy: old log-probs, PPO updates, SFT warm-start steps, checkpoints, HF export
* `RefWorker` -- the frozen reference policy's log-probs
* `CriticWorker` -- values and value-loss updates
* `RewardWorker` -- rule-based outcome scores of decoded responses
* `ActorRolloutWorker` -- actor + rollout engine in one process (colocated, in-process weight sync)
* `RolloutWorker` / `DisaggregatedActorWorker` -- rollout on its own pool, weights broadcast in buckets
  (driven from the controller by `workers.weight_sync.WeightSync`)

Each is a `controller.Worker` built from the config dataclasses in `workers.config`; heavy setup happens in
``init_model()`` (call it on the group once). `workers.roles.common` holds what the engine roles share.
"""

from workers.roles.actor import ActorWorker
from workers.roles.actor_rollout import ActorRolloutWorker, DisaggregatedActorWorker
from workers.roles.critic import CriticWorker
from workers.roles.reference import RefWorker
from workers.roles.reward import RewardWorker
from workers.roles.rollout import RolloutWorker

__all__ = [
    "ActorRolloutWorker",
    "ActorWorker",
    "CriticWorker",
    "DisaggregatedActorWorker",
    "RefWorker",
    "RewardWorker",
    "RolloutWorker",
]
