"""Suite-wide setup."""
import signal

# A shell without job control starts a background command with SIGINT ignored, and Python then installs no handler
# of its own: `_thread.interrupt_main` does nothing and the Ctrl-C tests see no interrupt (`nohup make test &`).
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)
