"""Wake-up signals between the ingest process and the forwarder process (UNIX datagrams)."""
