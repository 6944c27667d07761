"""Tensor parallelism: one model replica split across ranks (processes, one device each).

``shard`` says what each rank holds, ``group`` is a rank's collectives, ``step`` the one
broadcast a step costs, ``launch`` rank 0's handle on the others, ``worker`` the others.
"""
