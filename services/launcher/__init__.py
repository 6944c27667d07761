"""The ``meshserve`` command (``cli``) and ``meshserve up``, which starts a whole mesh locally
(``up``: its processes in ``mesh``, their restarts in ``supervisor``)."""
