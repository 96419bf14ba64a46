"""A small generated image task (no downloads) for the default main job and the framework's tests."""
