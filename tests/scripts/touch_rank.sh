#!/bin/sh
# A non-Python worker (--no-python): one file per rank in $1.
touch "$1/$RANK"
