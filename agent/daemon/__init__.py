"""The daemon: starts, watches and stops the stages (``agent.py``); restarts a dead forwarder."""
