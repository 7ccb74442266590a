"""Where ranks come from and how cases reach them: a torchrun launch's case loop, or warm pools."""
