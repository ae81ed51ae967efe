"""Engines that drive the model: LocalEngine is the single-process reference."""
