"""One module per benchmark; each has ``main(argv)`` printing one JSON line."""
