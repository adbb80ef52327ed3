"""`duet` commands that have grown past a few lines, one module each (``app/cli.py`` holds the
rest and the shared options): ``peer`` (``duet peer serve`` / ``plan``) and ``pairing``
(``duet peer pair`` / ``unpair``, ``duet peers``)."""
