"""What vulture (make lint: dead code in watchdog/) reports but is used: its allow-list.

Vulture reads names statically over watchdog/ alone. Each name here is read some way it cannot
see: by a protocol (`__aexit__`), by pydantic (`model_config`), by name from a list of strings or
through serialization (data fields written to summary.json, recordings and `--json` output), or
by the tests, demo and bench (the suites' hooks into the package). A name that becomes dead for
real goes from here and from the code together.
"""

# ruff: noqa
# mypy: ignore-errors
# fmt: off

# Protocol signatures: __aexit__(exc_type, exc, tb) in act/systemd.py and statefiles.py.
exc_type
tb

# pydantic reads it (config.py).
model_config

# Data fields read by name (decide/assess.py, decide/fold.py, evidence/classify.py and
# commands/check.py list metric names as strings) or only serialized (evidence summary.json,
# recordings, `watchdog check --json`).
inflight_queue
bootstrap_queue
decode_prealloc_queue
decode_transfer_queue
queue_reqs
requests_total
prompt_tokens_total
aborted_requests_total
http_requests_active
prefill_bootstrap_queue_reqs
decode_prealloc_queue_reqs
interval_seconds
next_steps
memory_used_mib
memory_total_mib
watchdog_version  # statusfile.py: in status.json, for people and `watchdog status --json`

# Read by tests, demo and bench (their hooks into the package; vulture does not scan them).
_.host_label  # act/hosts.py: tests/sandbox/test_multihost_sandbox.py
_.early_results  # act/systemd.py: tests/unit/test_systemd*.py
_.unit_reads_full  # act/systemd.py: tests/unit/test_systemd_fake_bus.py, tests/sandbox
_.unit_reads_remembered  # act/systemd.py: the same
_.health_for  # model.py
_.deltas_for  # observe/observer.py
_.internal_errors  # observe/observer.py, observe/probes/scheduler.py
_.skipped_multiround  # observe/probes/scheduler.py
_.origins  # observe/pool.py
_.enabled  # run/sdnotify.py: tests/unit/test_sdnotify.py
_.last_restart_at  # statefiles.py
write_config  # configfile.py
forget_secrets  # redact.py
read_header  # run/recording.py
read_recording  # run/recording.py
