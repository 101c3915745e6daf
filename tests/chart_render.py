"""Until the TLS tests (tests/test_tls*.py, tests/test_chart_tls*.py) move into the tree: `from chart_render
import` keeps working. Everything else imports tests/helpers/chart.py as `helpers.chart`."""
from helpers.chart import CHART, K8S_VERSION, by_kind, helm, one, render  # noqa: F401
