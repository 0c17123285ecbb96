"""Process entry point of one simulated SGLang PD worker: `python -m pdsim.worker --role ...`.

Parses the command line (timing model, SGLang version naming, TP size, faults), wires the
scheduler engine, the API server and, on prefill, the bootstrap server, and runs until SIGTERM.
Defaults are fast and suited to tests; SGLang's own timeouts can also come from its environment
variables (SGLANG_HEALTH_CHECK_TIMEOUT, SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT,
SGLANG_DISAGGREGATION_WAITING_TIMEOUT).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
import time
from pathlib import Path

from aiohttp import web

from pdsim import sglog
from pdsim.bootstrap import build_bootstrap_app
from pdsim.engine import DecodeEngine, Engine, EngineConfig, PrefillEngine
from pdsim.faults import FaultError, FaultSet
from pdsim.metrics import SUPPORTED_VERSIONS, SimMetrics, version_at_least
from pdsim.server import ServerInfo, build_api_app


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m pdsim.worker",
        description="Simulated SGLang prefill or decode server (PD disaggregation).",
    )
    p.add_argument(
        "--role", "--disaggregation-mode", dest="role", required=True, choices=("prefill", "decode")
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument(
        "--port", type=int, default=None, help="default: 30000 (prefill), 30002 (decode)"
    )
    p.add_argument(
        "--bootstrap-port",
        "--disaggregation-bootstrap-port",
        dest="bootstrap_port",
        type=int,
        default=8998,
        help="prefill only: the bootstrap listener's port",
    )
    p.add_argument("--tp-size", type=int, default=1)
    p.add_argument(
        "--dp-size",
        type=int,
        default=1,
        help="DP-attention ranks (pdsim/dp.py): a pinned request goes to its rank, others in turn",
    )
    p.add_argument(
        "--sglang-version",
        choices=SUPPORTED_VERSIONS,
        default="0.5.23",
        help="metric and log naming to imitate",
    )
    p.add_argument("--served-model-name", default="pdsim")
    p.add_argument("--prefill-ms-per-token", type=float, default=0.05)
    p.add_argument(
        "--decode-tokens-per-s",
        type=float,
        default=200.0,
        help="decode steps per second; each running request gets one token per step",
    )
    p.add_argument(
        "--max-running-requests", "--max-running", dest="max_running", type=int, default=16
    )
    p.add_argument("--max-prefill-tokens", type=int, default=16384)
    p.add_argument("--max-total-tokens", type=int, default=131072, help="KV pool size in tokens")
    p.add_argument("--transfer-ms", type=float, default=1.0, help="KV transfer time per request")
    p.add_argument("--decode-log-interval", type=int, default=40)
    p.add_argument(
        "--idle-report-s", type=float, default=30.0, help="gauge refresh period while fully idle"
    )
    p.add_argument(
        "--bootstrap-timeout-s",
        type=float,
        default=float(os.environ.get("SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT", "300")),
    )
    p.add_argument(
        "--waiting-timeout-s",
        type=float,
        default=float(os.environ.get("SGLANG_DISAGGREGATION_WAITING_TIMEOUT", "300")),
    )
    p.add_argument(
        "--health-timeout-s",
        type=float,
        default=float(os.environ.get("SGLANG_HEALTH_CHECK_TIMEOUT", "20")),
    )
    p.add_argument(
        "--health-poll-s",
        type=float,
        default=1.0,
        help="how often /health looks for scheduler output, after first waiting as long "
        "(SGLang: 1 s)",
    )
    p.add_argument(
        "--transfer-backend",
        "--disaggregation-transfer-backend",
        dest="transfer_backend",
        choices=("mooncake", "nixl"),
        default="mooncake",
        help="NIXL <= 0.5.5 cannot abort PD-queued requests and has no decode waiting timeout",
    )
    p.add_argument(
        "--enable-metrics",
        action="store_true",
        help="serve /metrics (off by default, as in SGLang: no /metrics route without it)",
    )
    p.add_argument("--api-key", default=None, help="key every non-probe endpoint requires")
    p.add_argument(
        "--admin-api-key",
        default=None,
        help="key /abort_request requires instead of --api-key when set",
    )
    compat = p.add_argument_group(
        "compatibility opt-ins",
        "pdsim's behaviour before it followed real SGLang (see README, Compatibility)",
    )
    compat.add_argument(
        "--fast-health",
        action="store_true",
        help="/health looks for output every 50 ms with no initial 1 s sleep",
    )
    compat.add_argument(
        "--legacy-aborts",
        action="store_true",
        help="rid prefix match, every rid recorded, aborts are neither KV failures nor finished "
        "requests, stuck transfers ignore aborts, decode times out only before the transfer",
    )
    compat.add_argument(
        "--legacy-streams",
        action="store_true",
        help="a PD failure before the first token is an HTTP error on every endpoint",
    )
    p.add_argument("--watchdog-timeout", dest="watchdog_timeout_s", type=float, default=300.0)
    p.add_argument(
        "--degraded-fail-fraction",
        type=float,
        default=0.5,
        help="share of transfers that fail once the bootstrap state is degraded",
    )
    p.add_argument(
        "--no-spontaneous-degrade",
        dest="spontaneous_degrade",
        action="store_false",
        help="never degrade when decode restarts under a running prefill",
    )
    p.add_argument("--seed", type=int, default=None, help="seed of the degraded-transfer dice")
    p.add_argument(
        "--fault-file",
        type=Path,
        default=None,
        help="JSON faults read at start (missing = none); persistent faults go here",
    )
    p.add_argument("--no-access-log", dest="access_log", action="store_false")
    return p


def _health_generation(version: str) -> bool:
    """SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION (sglang/srt/environ.py:344 @ 0.5.23, from 0.5.9):
    false makes GET /health a static 200 (sglang/srt/entrypoints/http_server.py:745-749)."""
    if not version_at_least(version, "0.5.9"):
        return True
    raw = os.environ.get("SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION", "true")
    return raw.strip().lower() not in ("0", "false", "no", "off", "n", "f")


def _crash(exit_code: int, sig: int) -> None:
    sglog.log("Scheduler hit an exception: RuntimeError: pdsim crash_after fault")
    sglog.log_plain("Received sigquit from a child process. It usually means the child failed.")
    if sig:
        os.kill(os.getpid(), sig)
    os._exit(exit_code)


async def _fault_ticker(faults: FaultSet) -> None:
    while True:
        fault = faults.get("crash_after")
        if fault is not None and time.monotonic() - fault.set_at_monotonic >= fault.param(
            "seconds"
        ):
            _crash(int(fault.param("exit_code")), int(fault.param("signal")))
        await asyncio.sleep(0.05)


def _quiet_aiohttp_server_log() -> None:
    # The router probes workers with an HTTP/2 preface first; aiohttp would print a traceback for
    # each. The access log already shows the 400, as uvicorn's "Invalid HTTP request" would.
    logging.getLogger("aiohttp.server").setLevel(logging.CRITICAL)


def _on_sigterm() -> None:
    sglog.log_plain("INFO:     Shutting down")
    sglog.log("SIGTERM received, exiting.")
    # In-flight requests are dropped with their connections, as when SGLang's process tree dies.
    os._exit(0)


async def serve(args: argparse.Namespace) -> None:
    _quiet_aiohttp_server_log()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, _on_sigterm)
    loop.add_signal_handler(signal.SIGINT, _on_sigterm)
    faults = FaultSet(args.fault_file)
    faults.load_startup(os.environ.get("PDSIM_FAULTS"))
    cfg = EngineConfig(
        role=args.role,
        version=args.sglang_version,
        tp_size=args.tp_size,
        dp_size=args.dp_size,
        model_name=args.served_model_name,
        url=f"http://{args.host}:{args.port}",
        prefill_ms_per_token=args.prefill_ms_per_token,
        decode_tokens_per_s=args.decode_tokens_per_s,
        max_running=args.max_running,
        max_prefill_tokens=args.max_prefill_tokens,
        max_total_tokens=args.max_total_tokens,
        transfer_ms=args.transfer_ms,
        decode_log_interval=args.decode_log_interval,
        idle_report_s=args.idle_report_s,
        bootstrap_timeout_s=args.bootstrap_timeout_s,
        waiting_timeout_s=args.waiting_timeout_s,
        health_timeout_s=args.health_timeout_s,
        health_poll_s=0.05 if args.fast_health else args.health_poll_s,
        transfer_backend=args.transfer_backend,
        legacy_aborts=args.legacy_aborts,
        watchdog_timeout_s=args.watchdog_timeout_s,
        degraded_fail_fraction=args.degraded_fail_fraction,
        spontaneous_degrade=args.spontaneous_degrade,
        seed=args.seed,
    )
    metrics = SimMetrics(
        version=args.sglang_version,
        role=args.role,
        tp_size=args.tp_size,
        model_name=args.served_model_name,
        dp_size=args.dp_size,
    )
    engine: Engine
    if args.role == "prefill":
        engine = PrefillEngine(cfg, faults, metrics)
    else:
        engine = DecodeEngine(cfg, faults, metrics)
        await engine.start_client()
    bootstrap_port = args.bootstrap_port if args.role == "prefill" else None
    sglog.log(
        f"server_args=ServerArgs(served_model_name={args.served_model_name!r}, host={args.host!r}, "
        f"port={args.port}, tp_size={args.tp_size}, disaggregation_mode={args.role!r}, "
        f"disaggregation_bootstrap_port={args.bootstrap_port}, "
        f"disaggregation_transfer_backend={args.transfer_backend!r}, "
        f"enable_metrics={args.enable_metrics}, "
        f"decode_log_interval={args.decode_log_interval}, "
        f"watchdog_timeout={args.watchdog_timeout_s}, max_running_requests={args.max_running}, "
        f"pdsim_version={args.sglang_version!r})"
    )
    info = ServerInfo(
        role=args.role,
        version=args.sglang_version,
        host=args.host,
        port=args.port,
        bootstrap_port=bootstrap_port,
        tp_size=args.tp_size,
        model_name=args.served_model_name,
        max_running=args.max_running,
        decode_log_interval=args.decode_log_interval,
        watchdog_timeout_s=args.watchdog_timeout_s,
        fault_file=str(args.fault_file) if args.fault_file else None,
        transfer_backend=args.transfer_backend,
        legacy_streams=args.legacy_streams,
        health_generation=_health_generation(args.sglang_version),
        enable_metrics=args.enable_metrics,
        api_key=args.api_key,
        admin_api_key=args.admin_api_key,
    )
    runners: list[web.AppRunner] = []
    async with asyncio.TaskGroup() as tg:
        tg.create_task(engine.run())
        tg.create_task(engine.watchdog())
        tg.create_task(_fault_ticker(faults))
        if isinstance(engine, PrefillEngine):
            boot = web.AppRunner(build_bootstrap_app(engine), access_log=None)
            await boot.setup()
            await web.TCPSite(boot, args.host, args.bootstrap_port).start()
            runners.append(boot)
        slow = faults.get("slow_start")
        if slow is not None and not slow.param("listen"):
            # Model load: SGLang binds its HTTP port only once the weights are loaded.
            await asyncio.sleep(float(slow.param("seconds")))
        app = build_api_app(engine, faults, metrics, info)
        if args.access_log:
            api = web.AppRunner(app, access_log_class=sglog.UvicornStyleAccessLogger)
        else:
            api = web.AppRunner(app, access_log=None)
        await api.setup()
        await web.TCPSite(api, args.host, args.port).start()
        runners.append(api)
        sglog.log_plain(f"INFO:     Started server process [{os.getpid()}]")
        sglog.log_plain("INFO:     Waiting for application startup.")
        sglog.log_plain("INFO:     Application startup complete.")
        sglog.log_plain(
            f"INFO:     Uvicorn running on http://{args.host}:{args.port} (Press CTRL+C to quit)"
        )
        sglog.log("The server is fired up and ready to roll!")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.port is None:
        # The incident deployment's ports (docs/sglang.md §6).
        args.port = 30000 if args.role == "prefill" else 30002
    try:
        # Validate faults before binding anything, so a bad fault file fails the unit at once.
        FaultSet(args.fault_file).load_startup(os.environ.get("PDSIM_FAULTS"))
    except FaultError as exc:
        print(f"pdsim: invalid fault configuration: {exc}", file=sys.stderr)
        return 2
    asyncio.run(serve(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
