"""What test modules share, imported as `helpers.<module>` (tests/ is on pytest's `pythonpath`); no test module
imports another (tests/test_layout_of_tests.py checks it).

    models        tiny random Llama folders (never downloads) and transformers' own model for them
    reference     the ground truth: transformers' greedy decoding, seeded sampling; prompts; a byte tokenizer
    shard         stage runners of a model in-process; chains of nodes; a micro-batch through the runners
    drafts        draft sources: always right, always wrong, and each kind by name
    stage_servers in-process gRPC stage servers; real stage processes
    pipe          a raw client of a stage pipeline (Forward, Results, Control)
    openai_server stages + coordinator + the OpenAI HTTP API on free ports, and an `openai` client of it
    wait          waiting on a condition with a deadline (instead of sleeping); waiting until nothing is left
    fuzz_harness  real services on a background event loop, for synchronous hypothesis tests
    chart         the Helm chart rendered by the pinned helm; value sets; label selectors
    forked        programs for the fork server's tests to fork (common/forkserver.py)
"""
