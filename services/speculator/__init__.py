"""The speculator: a draft model that proposes tokens for the executors to verify."""
