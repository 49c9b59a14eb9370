"""Weight transport pieces shared by the trainer (send side) and the engine (receive side)."""
