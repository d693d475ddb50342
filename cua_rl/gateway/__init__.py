"""The rollout gateway: the OpenAI endpoint each episode hands its agent.

The trainer owns every model call. Each episode opens a session on its worker's gateway and
gives the agent ``http://HOST:PORT/episodes/<rollout_uuid>/v1`` as its model base URL. The
gateway samples with the trainer's settings, through AReaL's engine semantics (waits out weight
updates, finishes calls a weight update cut, tags each token with the version that sampled it),
sends token ids rather than re-rendered history, and captures the ids, logprobs, versions and
images the row is then built from.

    config.py   bind / advertised address, limits, sampling-mismatch policy; ``Sampling``
    render.py   messages -> prompt ids, extending the stored conversation (pure)
    engine.py   one call through the engine: pause, abort and retry handling, versions
    weight_pauses.py  the pauses for weight updates each engine had, and the bound a waiting
                      call gets from them
    model_outages.py  the model-server outages the gateway is holding calls through
    requests.py what a request may ask: the trainer's sampling, tools, token bytes
    session.py  one episode: re-sends, images, capture, the OpenAI answer
    capture.py  what an episode captured, and its turns for the row builder
    app.py      the HTTP routes and OpenAI-shaped errors
    server.py   a worker's gateway: its HTTP server and episode registry
"""

from cua_rl.gateway.capture import CapturedTurn, EpisodeCapture
from cua_rl.gateway.config import GatewayConfig, Sampling
from cua_rl.gateway.engine import AReaLEngineView, EngineView
from cua_rl.gateway.server import Gateway
from cua_rl.gateway.session import SessionSpec

__all__ = [
    "AReaLEngineView",
    "CapturedTurn",
    "EngineView",
    "EpisodeCapture",
    "Gateway",
    "GatewayConfig",
    "Sampling",
    "SessionSpec",
]
