"""The executor: one model replica driving the engine's step loop for the mesh."""
