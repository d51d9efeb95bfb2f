# metronome code harness: runs a program, then its assert-style tests one by one, and
# reports each on a saved copy of standard output behind a nonce. The nonce and the
# tests come on standard input, read before the program starts (which then sees
# /dev/null there), so neither is on the command line. Printing, exiting early,
# killing the process or raising SystemExit cannot report a pass.
import json
import os
import sys


def _describe(e):
    message = str(e)
    text = type(e).__name__ + (": " + message if message else "")
    text = text.replace("\n", " ").replace("\r", " ")
    return text[:300]


def _main():
    nonce = sys.stdin.readline().strip()
    spec = json.loads(sys.stdin.readline())
    setup, tests = spec["setup"], spec["tests"]
    del spec
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    report = os.dup(1)
    write = os.write
    program = sys.argv[1]
    del sys.argv[1:]
    compile_ = compile
    exec_ = exec

    def say(line):
        try:
            sys.stdout.flush()
        except BaseException:
            pass
        write(report, ("\n" + nonce + " " + line + "\n").encode("utf-8", "replace"))

    namespace = {"__name__": "__main__", "__builtins__": __builtins__}
    for name, code in (("program", program), ("setup", setup)):
        try:
            exec_(compile_(code, "<" + name + ">", "exec"), namespace)
        except BaseException as e:
            say("error " + name + " " + _describe(e))
            return
    say("ready")
    for i, test in enumerate(tests):
        try:
            exec_(compile_(test, "<test %d>" % i, "exec"), namespace)
        except BaseException as e:
            say("fail %d %s" % (i, _describe(e)))
        else:
            say("pass %d" % i)
    say("done")


_main()
