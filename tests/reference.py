"""Until the TLS tests (tests/test_tls*.py, tests/test_chart_tls*.py) move into the tree: `from reference import`
keeps working. Everything else imports tests/helpers/reference.py as `helpers.reference`."""
from helpers.reference import byte_tokenizer, hf_greedy, prompts  # noqa: F401
