"""Model configs, reference modules, checkpoint loaders and the export of entry points."""
