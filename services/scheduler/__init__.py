"""The scheduler: global queue, admission, routing across executors."""
