"""What drives a context: single-prompt generation, llama.cpp's parallel workload, and the session
that runs either on a worker thread for the front-ends. Import the module you need; this package
imports nothing by itself, so that a torch-free client (the remote session) stays torch-free."""
