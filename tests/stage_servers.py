"""Until the TLS tests (tests/test_tls*.py, tests/test_chart_tls*.py) move into the tree: `from stage_servers import`
keeps working. Everything else imports tests/helpers/stage_servers.py as `helpers.stage_servers`."""
from helpers.stage_servers import local_processes, stage_servers  # noqa: F401
