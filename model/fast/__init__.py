"""Fast paths, applied to a built model from outside (model/model.py knows none of them):
stacked projections (fuse.py), float32 weights prepacked for oneDNN (prepack.py), compiled
cached calls (compile.py, kept on disk by aot.py), and the choice among them (setup.py, entry
point :func:`~model.fast.setup.choose_setups`)."""
