"""The driver, the top floor: composition root (`build`), run loop (`run`), run directory, restarts, metrics."""
