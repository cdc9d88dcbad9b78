"""Mooncake as the store: the client (``store``), an embedded ``mooncake_master``
(``master``), the start-up checks and connection (``setup``), and its error codes
(``codes``)."""
