"""The running bridge process: its command line (`cli`), its configuration (`config`), its
Prometheus metrics (`metrics`) and its worker processes sharing one port (`workers`)."""
