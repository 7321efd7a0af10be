"""tidal's test plugins: one of each kind, found through the entry points in pyproject.toml.

Settings come from the environment of the process they run in (tests set it for the server):
``TIDAL_TEST_BANNED_ID``, ``TIDAL_TEST_STATS_FILE``, ``TIDAL_TEST_LORA_DIR``,
``TIDAL_TEST_PLATFORM``, ``TIDAL_TEST_PLUGIN_FAIL``.
"""
