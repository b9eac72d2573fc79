"""kvscope's terminal explorer (Textual): live cell grids, device memory and sliding windows of a session,
a recording or a remote engine. It stands on the session, the watch layer and the event records only
(tests/test_frontend_imports.py checks it)."""
