"""Campaigns against a running server, one command each (``python -m gyrfalcon.campaigns NAME``,
or the nox session of the same name); each prints what it counted and whether its target was met.

- ``slow-clients``: idle, one-byte and non-reading connections beside a normal client;
- ``sigterm``: SIGTERM with queued and running work;
- ``soak``: thousands of mixed requests, aborted streams and invalid bodies;
- ``fuzz``: Schemathesis with 1,000 examples per operation against the served spec;
- ``abuse``: each attack of the hardening issue (bodies costly to refuse, distinct large schemas,
  texts beyond the context, too much work, stored responses' ids, scrapes) beside a normal client.

The test suite runs short versions of each on the tiny model (``tests/live/test_campaigns.py``).
"""
