"""A plugin that registers nothing (config `plugins: [tests.load_thread_plugins]`): it appends
the importing process's pid and thread to the file $SILO_PFL_TEST_LOAD_RECORD, so that a test can
tell on which thread the driver checked its config."""

from __future__ import annotations

import json
import os
import threading

_RECORD = os.environ.get("SILO_PFL_TEST_LOAD_RECORD")
if _RECORD:
    thread = threading.current_thread()
    with open(_RECORD, "a", encoding="utf-8") as record:
        line = {
            "pid": os.getpid(),
            "thread": thread.name,
            "main": thread is threading.main_thread(),
        }
        record.write(json.dumps(line) + "\n")
