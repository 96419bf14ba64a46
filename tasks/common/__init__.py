"""Pieces every task shares: the classification LightningModule, optimisers and schedules, callbacks, run records."""
