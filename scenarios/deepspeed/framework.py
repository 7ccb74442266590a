"""DeepSpeed (pinned CPU build: its ops not built, its sdist built against the installed torch)."""

from harness.cases.frameworks import Framework


RELEASES = ("0.14.5", "0.15.4", "0.16.9", "0.17.6", "0.18.9", "0.19.8")
"""DeepSpeed releases that install here on CPU and run both adapters (``deepspeed`` and
``deepspeed-engine``, the latter through ``deepspeed.moe.layer.MoE`` and ``engine.backward``), oldest
first; the last is the pin. Each installs as the pin does, its ops not built, into a scratch venv that
sees the project's packages (ARCHITECTURE.md, "scratch venvs"):
``DS_BUILD_OPS=0 pip install --no-deps --no-build-isolation deepspeed==X``; none needs anything more
(the project venv's hjson, ninja, py-cpuinfo, msgpack, pydantic 2, psutil serve all six). Every one
gives the same numbers at world 2 (the mean of per-rank norms under ep > 1, the idle-rank IndexError /
RuntimeError); both repro scripts run unchanged on 0.14.5 and 0.19.8."""

FRAMEWORK = Framework(
    "deepspeed", "deepspeed.runtime.utils", "deepspeed",
    "pip install 'clipcheck[deepspeed]' (CPU: DS_BUILD_OPS=0 pip install --no-build-isolation deepspeed==0.19.8)",
    recipe=("DS_BUILD_OPS=0 pip install --no-build-isolation deepspeed==0.19.8",),
    releases=RELEASES)
