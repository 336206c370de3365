"""KV jobs (loads and stores of KV blocks to an outside store): the job book-keeping (`jobs`) and
how the scheduler issues and applies them (`scheduler_hooks`)."""
