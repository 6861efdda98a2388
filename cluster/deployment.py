"""What gateways need to find a deployment on its Ray cluster: a named actor ("duospec-deployment",
namespace "duospec") holding each model's config and facts, its replicas' scheduler actors, and the
internal data plane's secret and TLS. `duospec serve` with server.gateways > 1 publishes it after
placing the workers and their schedulers; every gateway — on this node or added with `duospec serve
--gateway-only --address RAY_ADDRESS` on another — reads it once at start. Only drivers of the Ray
cluster (which Ray's token authentication admits) can read it, as they could read the workers'
constructor arguments that carry the same secret.
"""

from __future__ import annotations

import asyncio
import dataclasses

from duospec.cluster.runtime import NAMESPACE

REGISTRY_NAME = "duospec-deployment"


class DeploymentRegistry:
    """Ray actor: the deployment's description, as `describe()` returns it."""

    def __init__(self, description: dict):
        self._description = description

    def describe(self) -> dict:
        return self._description


@dataclasses.dataclass
class PublishedDeployment:
    registry: object  # ray ActorHandle of the DeploymentRegistry
    schedulers: list  # every replica's SchedulerActor handle

    def shutdown(self) -> None:
        import ray

        for handle in [*self.schedulers, self.registry]:
            try:
                ray.kill(handle, no_restart=True)
            except Exception:  # already gone
                pass


def publish(pipeline, models: list) -> PublishedDeployment:
    """Starts a scheduler actor for every replica of `pipeline` (coordinator/pipeline.py's, whose pairs
    are placed and loaded) and the registry describing them. `models`: the served ModelConfigs."""
    import ray

    from duospec.cluster.scheduler_actor import launch_scheduler

    described, schedulers = [], []
    for config in models:
        launched = [(info, pair) for info, pair in pipeline.launched if info.name == config.name]
        handles = [launch_scheduler(config, info, pair) for info, pair in launched]
        schedulers += handles
        described.append({"config": config, "info": launched[0][0], "schedulers": handles})
    first = pipeline.launched[0][1]
    registry = ray.remote(DeploymentRegistry).options(name=REGISTRY_NAME, namespace=NAMESPACE, num_cpus=0).remote(
        {"models": described, "secret": first.deployment_secret, "internal_tls": first.internal_tls})
    return PublishedDeployment(registry, schedulers)


async def describe(timeout_s: float) -> dict:
    """The deployment this Ray driver's cluster serves; waits up to `timeout_s` for it to be published."""
    import ray

    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        try:
            handle = ray.get_actor(REGISTRY_NAME, namespace=NAMESPACE)
            return await asyncio.wait_for(handle.describe.remote(), max(1.0, deadline - loop.time()))
        except (ValueError, asyncio.TimeoutError) as exc:  # not published (yet)
            if loop.time() >= deadline:
                raise ConnectionError(
                    "no duospec deployment on this Ray cluster: start one with `duospec serve --gateways N` "
                    f"(or server.gateways > 1) before adding gateways ({exc})") from None
            await asyncio.sleep(0.5)
