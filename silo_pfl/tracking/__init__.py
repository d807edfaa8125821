"""MLflow integration: the federation's runs, every silo's registered personalized model.

Importing this package does not import MLflow; only the modules that talk to a store do, and
they are imported only when `tracking.enabled` is true.

  uri.py       store URIs: syntax checks at config load, the embedded SQLite default
  store.py     opening a store and its experiment, with one-line errors before round 1
  tracker.py   MlflowTracker, the driver-side Callback: parent/child runs, metrics, artifacts
  exporter.py  MlflowExporter, run by each silo in its own process: writes its model's files
  pyfunc.py    the served model: raw rows -> source encoder -> Preprocessing -> network
  registry.py  the one registration path (publish) and the champion alias
  listing.py   what `silo-pfl models` shows
"""

import os

# No network at run time: MLflow's usage telemetry stays off unless the operator turns it on
# (it also raced with our store-opening thread: a KeyError on its session id variable).
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
# MLflow prints "View run ... at: <store URI>" when it ends a run in an HTTP store, password and
# all, on stdout (set_terminated, in the driver and in a silo's process alike). Never: every
# process that talks to a store imports this package first; the run's own lines are redacted.
os.environ["MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT"] = "true"
# A store that stops answering mid-run: MLflow retries each request 7 times with a backoff
# factor of 2, about 4 minutes a call, while the rounds wait. 3 retries with a factor of 1 give
# up within about 10 s, and the run stops, naming tracking.uri; the operator's values win.
os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "3")
os.environ.setdefault("MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", "1")
