"""What the inference environment holds, run with its own interpreter (``--check``'s stack line).

    <inference python> -m cua_rl.inference.probe [server arguments ...]

imports vLLM and torch, installs the server module's routes on vLLM's app factory (which
imports every vLLM module ``cua_rl.inference.vllm_server`` relies on), and parses the given
arguments (those AReaL builds from the config's ``vllm:`` section) with the server's own
parser, as the rollout worker's launch would. Prints one JSON object on its last line: the
versions, whether CUDA is visible there, and one message per failed part (empty when it
passed). The trainer side (``cua_rl.app.stack``) turns it into check lines; nothing here
imports AReaL.
"""

from __future__ import annotations

import contextlib
import io
import json
import sys

RESULT_PREFIX = "inference-probe "


def _versions(report: dict) -> None:
    import torch
    import vllm

    report["vllm"] = vllm.__version__
    report["torch"] = torch.__version__
    report["cuda_devices"] = torch.cuda.device_count() if torch.cuda.is_available() else 0


def _server_module(report: dict) -> None:
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir  # noqa: F401 (main)

    from cua_rl.inference import vllm_server

    vllm_server._install_routes()
    vllm_server._modelinfo_folder()


def _arguments(report: dict, argv: list[str]) -> None:
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from cua_rl.inference.vllm_server import _rewrite_argv

    parser = make_arg_parser(FlexibleArgumentParser(description="probe"))
    errors = io.StringIO()
    try:
        with contextlib.redirect_stderr(errors):
            parser.parse_args(_rewrite_argv(argv))
    except SystemExit:
        lines = [line for line in errors.getvalue().splitlines() if "error:" in line]
        raise ValueError(lines[-1] if lines else errors.getvalue().strip()[-300:]) from None
    report["arguments"] = len([a for a in argv if a.startswith("--")])


def probe(argv: list[str]) -> dict:
    report: dict = {"python": sys.executable, "problems": {}}
    parts = (("vllm", _versions), ("server_module", _server_module))
    for name, step in parts:
        try:
            step(report)
        except Exception as exc:
            report["problems"][name] = f"{type(exc).__name__}: {exc}"
            return report
    try:
        _arguments(report, argv)
    except Exception as exc:
        report["problems"]["arguments"] = str(exc)
    return report


def main() -> None:
    print(RESULT_PREFIX + json.dumps(probe(sys.argv[1:])), flush=True)


if __name__ == "__main__":
    main()
