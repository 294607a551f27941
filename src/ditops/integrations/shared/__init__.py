"""What every model family's patch is built from: the change records (``base``), the
declared-family skeleton (``family``), the guard that runs a block unfused while others
hook what it bypasses (``guard``), step tracking (``steps``), the norm swap and generic
family (``norms``), adaLN-Zero pieces (``adaln_zero``) and context parallelism
(``parallel``)."""
