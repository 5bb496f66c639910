#!/usr/bin/env python3
"""`ferrite serve` against the official `openai` Python client (CI, CPU backend, default model).

Usage: python3 tests/openai_client/test_server.py [path/to/ferrite]
(default: target/release/ferrite). Starts its own servers on free loopback ports and stops
them at the end; needs `pip install openai`. Plain unittest, no pytest.
"""

import concurrent.futures
import json
import os
import socket
import subprocess
import sys
import time
import unittest
import urllib.error
import urllib.request

import openai

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BIN = os.environ.get("FERRITE_BIN") or os.path.join(ROOT, "target", "release", "ferrite")
KEY = "sk-test-ferrite"
MAX_CONTEXT = 1024


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, *extra):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [BIN, "serve", "--port", str(self.port), "--max-context", str(MAX_CONTEXT),
               "--max-body-bytes", "100000", *extra]
        env = dict(os.environ, RUST_LOG=os.environ.get("RUST_LOG", "warn"))
        self.proc = subprocess.Popen(cmd, env=env)
        deadline = time.time() + 300  # the first run may fetch the default model
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"ferrite serve exited with {self.proc.returncode}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError, OSError):
                pass
            if time.time() > deadline:
                self.stop()
                raise RuntimeError("ferrite serve did not come up")
            time.sleep(0.2)
        models = self.get("/v1/models", key=KEY)[1]
        self.model = models["data"][0]["id"]

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def request(self, method, path, body=None, key=None, raw=None):
        data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
        req = urllib.request.Request(self.url + path, data=data, method=method)
        req.add_header("Content-Type", "application/json")
        if key:
            req.add_header("Authorization", f"Bearer {key}")
        try:
            with urllib.request.urlopen(req, timeout=120) as r:
                text = r.read().decode()
                return r.status, (json.loads(text) if text.startswith("{") else text), dict(r.headers)
        except urllib.error.HTTPError as e:
            text = e.read().decode()
            return e.code, json.loads(text), dict(e.headers)

    def get(self, path, key=None):
        return self.request("GET", path, key=key)[:2]

    def post(self, path, body, key=None, raw=None):
        return self.request("POST", path, body, key=key, raw=raw)

    def client(self, key=None):
        return openai.OpenAI(base_url=self.url + "/v1", api_key=key or "unused", timeout=120,
                             max_retries=0)


def tokenize(text):
    out = subprocess.run([BIN, "tokenize", "--text", text], capture_output=True, text=True,
                         check=True, timeout=120)
    return json.loads(out.stdout)


SERVER = None


def setUpModule():
    global SERVER
    SERVER = Server()


def tearDownModule():
    if SERVER:
        SERVER.stop()


def chat(messages, **kw):
    kw.setdefault("temperature", 0)
    kw.setdefault("max_tokens", 24)
    return SERVER.client().chat.completions.create(model=SERVER.model, messages=messages, **kw)


class Chat(unittest.TestCase):
    def test_known_answer_and_shape(self):
        r = chat([{"role": "user", "content": "What is the capital of France?"}])
        self.assertEqual(r.object, "chat.completion")
        self.assertEqual(r.choices[0].message.role, "assistant")
        self.assertIn("Paris", r.choices[0].message.content)
        self.assertEqual(r.choices[0].finish_reason, "stop")
        self.assertEqual(r.usage.total_tokens, r.usage.prompt_tokens + r.usage.completion_tokens)
        self.assertGreater(r.usage.completion_tokens, 0)

    def test_length_finish(self):
        r = chat([{"role": "user", "content": "Write a long story about a dragon."}], max_tokens=5)
        self.assertEqual(r.choices[0].finish_reason, "length")
        self.assertEqual(r.usage.completion_tokens, 5)

    def test_multi_turn_and_system(self):
        msgs = [
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "What is the capital of France?"},
            {"role": "assistant", "content": "The capital of France is Paris."},
            {"role": "user", "content": "And of Germany?"},
        ]
        r = chat(msgs)
        one = chat(msgs[:2])
        self.assertGreater(r.usage.prompt_tokens, one.usage.prompt_tokens + 10)
        self.assertTrue(r.choices[0].message.content)

    def test_json_mode(self):
        msgs = [{"role": "user", "content": "Describe Paris as a JSON object with the keys "
                 "name, country and population."}]
        for kw in ({}, {"temperature": 0.8, "seed": 3}):
            r = chat(msgs, max_tokens=200, response_format={"type": "json_object"}, **kw)
            obj = json.loads(r.choices[0].message.content)
            self.assertIsInstance(obj, dict)
            self.assertEqual(r.choices[0].finish_reason, "stop")

    def test_structured_output(self):
        schema = {"type": "object",
                  "properties": {"city": {"type": "string"}, "population": {"type": "integer"},
                                 "continent": {"enum": ["Europe", "Asia"]}},
                  "required": ["city", "population", "continent"],
                  "additionalProperties": False}
        msgs = [{"role": "user", "content": "Give the city, population and continent of Paris."}]
        r = chat(msgs, max_tokens=200, response_format={
            "type": "json_schema", "json_schema": {"name": "city", "schema": schema, "strict": True}})
        obj = json.loads(r.choices[0].message.content)
        self.assertEqual(set(obj), {"city", "population", "continent"})
        self.assertIsInstance(obj["city"], str)
        self.assertIsInstance(obj["population"], int)
        self.assertIn(obj["continent"], ["Europe", "Asia"])

    def test_prefix_cache_reports_cached_tokens(self):
        # A long system prompt, asked twice: the second request's prompt starts with pages
        # the first one left in the prefix cache; its answer is the same.
        system = ("You are a meticulous geography tutor. Answer every question in one short "
                  "sentence, name the country and its capital, and never use lists. ") * 2
        msgs = [{"role": "system", "content": system},
                {"role": "user", "content": "What is the capital of Italy?"}]
        first = chat(msgs)
        second = chat(msgs)
        self.assertEqual(second.choices[0].message.content, first.choices[0].message.content)
        self.assertGreaterEqual(second.usage.prompt_tokens_details.cached_tokens, 32)
        self.assertLess(second.usage.prompt_tokens_details.cached_tokens,
                        second.usage.prompt_tokens)
        self.assertEqual(second.usage.prompt_tokens, first.usage.prompt_tokens)

    def test_streaming_matches_non_streaming(self):
        msgs = [{"role": "user", "content": "Name three fruits."}]
        full = chat(msgs, max_tokens=30)
        chunks = list(chat(msgs, max_tokens=30, stream=True,
                           stream_options={"include_usage": True}))
        self.assertEqual(chunks[0].choices[0].delta.role, "assistant")
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        self.assertEqual(text, full.choices[0].message.content)
        finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
        self.assertEqual(len(finals), 1)
        self.assertEqual(finals[0].choices[0].finish_reason, full.choices[0].finish_reason)
        self.assertEqual(chunks[-1].choices, [])
        self.assertEqual(chunks[-1].usage.completion_tokens, full.usage.completion_tokens)
        self.assertEqual(chunks[-1].usage.prompt_tokens, full.usage.prompt_tokens)
        # Without include_usage there is no usage chunk.
        chunks = list(chat(msgs, max_tokens=5, stream=True))
        self.assertTrue(all(c.choices for c in chunks))

    def test_stop_string(self):
        msgs = [{"role": "user", "content": "What is the capital of France?"}]
        r = chat(msgs, stop=[" is"])
        self.assertEqual(r.choices[0].message.content, "The capital of France")
        self.assertEqual(r.choices[0].finish_reason, "stop")
        chunks = list(chat(msgs, stop=" is", stream=True))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        self.assertEqual(text, "The capital of France")

    def test_seed_reproduces(self):
        msgs = [{"role": "user", "content": "Tell me a short story."}]
        a = chat(msgs, temperature=1.0, seed=1234, max_tokens=20)
        b = chat(msgs, temperature=1.0, seed=1234, max_tokens=20)
        c = chat(msgs, temperature=1.0, seed=99, max_tokens=20, top_p=0.9,
                 extra_body={"min_p": 0.05, "top_k": 50}, presence_penalty=0.5, frequency_penalty=0.5)
        self.assertEqual(a.choices[0].message.content, b.choices[0].message.content)
        self.assertTrue(c.choices[0].message.content)

    def test_logprobs(self):
        r = chat([{"role": "user", "content": "Hi"}], max_tokens=4, logprobs=True, top_logprobs=3)
        content = r.choices[0].logprobs.content
        self.assertEqual(len(content), r.usage.completion_tokens)
        for t in content:
            self.assertLessEqual(t.logprob, 0.0)
            self.assertEqual(len(t.top_logprobs), 3)
            # Greedy: the chosen token is the most likely one.
            self.assertAlmostEqual(t.logprob, t.top_logprobs[0].logprob, places=5)

    def test_n_choices_are_the_seeded_single_requests(self):
        msgs = [{"role": "user", "content": "Tell me a short story."}]
        r = chat(msgs, n=3, temperature=1.0, seed=5, max_tokens=12)
        self.assertEqual([c.index for c in r.choices], [0, 1, 2])
        singles = [chat(msgs, temperature=1.0, seed=5 + i, max_tokens=12) for i in range(3)]
        self.assertEqual([c.message.content for c in r.choices],
                         [s.choices[0].message.content for s in singles])
        self.assertEqual(r.usage.prompt_tokens, singles[0].usage.prompt_tokens)
        self.assertEqual(r.usage.completion_tokens,
                         sum(s.usage.completion_tokens for s in singles))
        # Greedy choices are all the greedy answer.
        g = chat([{"role": "user", "content": "What is the capital of France?"}], n=2)
        one = chat([{"role": "user", "content": "What is the capital of France?"}])
        self.assertEqual([c.message.content for c in g.choices],
                         [one.choices[0].message.content] * 2)

    def test_tools_are_accepted(self):
        tools = [{"type": "function", "function": {
            "name": "get_weather", "description": "Weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
        r = chat([{"role": "user", "content": "Weather in Paris?"}], tools=tools, max_tokens=8)
        self.assertIn(r.choices[0].finish_reason, ("stop", "length", "tool_calls"))

    def test_chat_template_kwargs_are_accepted(self):
        # SmolLM2's template reads no enable_thinking: the same prompt and the same answer.
        msgs = [{"role": "user", "content": "What is the capital of France?"}]
        r = chat(msgs, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
        one = chat(msgs)
        self.assertEqual(r.usage.prompt_tokens, one.usage.prompt_tokens)
        self.assertEqual(r.choices[0].message.content, one.choices[0].message.content)


class Completions(unittest.TestCase):
    def complete(self, prompt, **kw):
        kw.setdefault("temperature", 0)
        kw.setdefault("max_tokens", 12)
        return SERVER.client().completions.create(model=SERVER.model, prompt=prompt, **kw)

    def test_text_and_token_prompts_agree(self):
        prompt = "The capital of France is"
        ids = tokenize(prompt)
        a = self.complete(prompt)
        b = self.complete(ids)
        self.assertEqual(a.object, "text_completion")
        self.assertEqual(a.choices[0].text, b.choices[0].text)
        self.assertIn("Paris", a.choices[0].text)
        # Usage counts match the tokenizer.
        self.assertEqual(a.usage.prompt_tokens, len(ids))
        self.assertEqual(b.usage.prompt_tokens, len(ids))
        if a.choices[0].finish_reason == "length":
            self.assertEqual(a.usage.completion_tokens, 12)
        self.assertLessEqual(a.usage.completion_tokens, 12)

    def test_streaming(self):
        prompt = "Once upon a time"
        full = self.complete(prompt, max_tokens=16)
        chunks = list(self.complete(prompt, max_tokens=16, stream=True,
                                    stream_options={"include_usage": True}))
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        self.assertEqual(text, full.choices[0].text)
        self.assertEqual(chunks[-1].usage.completion_tokens, 16)
        self.assertEqual([c.choices[0].finish_reason for c in chunks if c.choices][-1], "length")

    def test_streaming_n_choices(self):
        prompt = "Once upon a time"
        kw = dict(max_tokens=10, n=2, temperature=0.8, seed=11)
        full = self.complete(prompt, **kw)
        chunks = list(self.complete(prompt, stream=True,
                                    stream_options={"include_usage": True}, **kw))
        texts = ["", ""]
        finals = []
        for c in chunks:
            for ch in c.choices:
                texts[ch.index] += ch.text
                if ch.finish_reason:
                    finals.append(ch.index)
        self.assertEqual(texts, [c.text for c in full.choices])
        self.assertEqual(sorted(finals), [0, 1])
        self.assertEqual(chunks[-1].choices, [])
        self.assertEqual(chunks[-1].usage.completion_tokens, full.usage.completion_tokens)
        self.assertEqual(chunks[-1].usage.prompt_tokens, full.usage.prompt_tokens)

    def test_logit_bias(self):
        # Forcing one token makes every greedy step choose it; banning the greedy answer's
        # first token makes the model say something else.
        prompt = "The capital of France is"
        base = self.complete(prompt, max_tokens=3, logprobs=1)
        paris = tokenize(" Paris")
        self.assertEqual(len(paris), 1, paris)
        forced = self.complete(prompt, max_tokens=3, logprobs=1, logit_bias={str(paris[0]): 100})
        self.assertEqual(forced.choices[0].text, " Paris" * 3)
        banned = self.complete(prompt, max_tokens=3, logprobs=1,
                               logit_bias={str(paris[0]): -100})
        self.assertNotIn("Paris", banned.choices[0].text)
        self.assertIn("Paris", base.choices[0].text)
        with self.assertRaises(openai.BadRequestError):
            self.complete(prompt, logit_bias={"99999999": 1})

    def test_logprobs(self):
        r = self.complete("1, 2, 3,", max_tokens=3, logprobs=2)
        lp = r.choices[0].logprobs
        self.assertEqual(len(lp.tokens), 3)
        self.assertEqual(len(lp.token_logprobs), 3)
        self.assertEqual(len(lp.top_logprobs[0]), 2)

    def test_concurrent_greedy_equals_alone(self):
        prompts = [
            "The capital of France is", "Once upon a time, in a small village,",
            "def fibonacci(n):", "The three primary colors are",
            "Water boils at a temperature of", "My favourite book is",
            "The quick brown fox", "In 1492, Columbus",
        ]
        alone = [self.complete(p, max_tokens=16).choices[0].text for p in prompts]
        with concurrent.futures.ThreadPoolExecutor(8) as ex:
            together = list(ex.map(lambda p: self.complete(p, max_tokens=16).choices[0].text,
                                   prompts))
        self.assertEqual(alone, together)


class BadInput(unittest.TestCase):
    def expect(self, status, body=None, path="/v1/chat/completions", raw=None, param=None):
        code, resp, headers = SERVER.post(path, body, raw=raw)
        self.assertEqual(code, status, resp)
        err = resp["error"]
        for k in ("message", "type", "param", "code"):
            self.assertIn(k, err)
        self.assertTrue(err["message"])
        if param:
            self.assertEqual(err["param"], param)
        return err, headers

    def good(self, **kw):
        b = {"model": SERVER.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        b.update(kw)
        return b

    def test_bad_requests(self):
        self.expect(400, raw=b'{"model": ')
        self.expect(400, raw=b'[1, 2]')
        self.expect(400, self.good(messages="hi"))
        self.expect(400, self.good(max_tokens="ten"))
        self.expect(404, self.good(model="gpt-4"))
        self.expect(400, self.good(messages=[]), param="messages")
        self.expect(400, self.good(max_tokens=0), param="max_tokens")
        self.expect(400, self.good(max_tokens=-1), param="max_tokens")
        self.expect(400, self.good(max_tokens=10**9), param="max_tokens")
        self.expect(400, self.good(n=0), param="n")
        self.expect(400, self.good(n=9), param="n")
        self.expect(400, self.good(temperature=-1), param="temperature")
        self.expect(400, self.good(chat_template_kwargs={"enable_thinking": "no"}),
                    param="chat_template_kwargs")
        self.expect(400, self.good(chat_template_kwargs=[True]))
        self.expect(400, self.good(response_format={"type": "json_schema", "json_schema": {}}),
                    param="response_format")
        self.expect(400, self.good(response_format={"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "object", "properties": {"a": {"minimum": 3}}}}}),
                    param="response_format")
        self.expect(400, self.good(logit_bias={"1": 500}), param="logit_bias")
        tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
        self.expect(400, self.good(tools=[tool], tool_choice="required"), param="tool_choice")
        self.expect(400, {"model": SERVER.model, "prompt": [1, 2], "n": -1}, path="/v1/completions")
        self.expect(400, {"model": SERVER.model, "prompt": [10**9]}, path="/v1/completions")

    def test_prompt_longer_than_context(self):
        err, _ = self.expect(400, self.good(messages=[{"role": "user", "content": "hello " * 1500}]),
                             param="messages")
        self.assertIn(str(MAX_CONTEXT), err["message"])
        err, _ = self.expect(400, {"model": SERVER.model, "prompt": "hello " * 1500},
                             path="/v1/completions", param="prompt")
        self.assertIn(str(MAX_CONTEXT), err["message"])
        err, _ = self.expect(400, {"model": SERVER.model, "prompt": "hi " * 500, "max_tokens": 800},
                             path="/v1/completions", param="max_tokens")
        self.assertIn(str(MAX_CONTEXT), err["message"])

    def test_body_too_large(self):
        self.expect(413, self.good(messages=[{"role": "user", "content": "x" * 200_000}]))

    def test_client_raises_openai_errors(self):
        with self.assertRaises(openai.NotFoundError):
            SERVER.client().chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
        with self.assertRaises(openai.BadRequestError):
            SERVER.client().chat.completions.create(model=SERVER.model, messages=[])

    def test_health_metrics_models(self):
        self.assertEqual(SERVER.get("/health")[0], 200)
        code, text = SERVER.get("/metrics")
        self.assertEqual(code, 200)
        for name in ("ferrite_requests_total", "ferrite_prompt_tokens_total",
                     "ferrite_generation_tokens_total", "ferrite_time_to_first_token_seconds_bucket",
                     "ferrite_inter_token_latency_seconds_count", "ferrite_requests_running",
                     "ferrite_requests_waiting", "ferrite_kv_pages_used", "ferrite_kv_pages_cached",
                     "ferrite_prefix_cache_hit_tokens_total"):
            self.assertIn(name, text)
        models = SERVER.client().models.list()
        self.assertEqual(models.data[0].id, SERVER.model)


class Saturation(unittest.TestCase):
    def test_full_queue_is_429_with_retry_after(self):
        s = Server("--max-batch", "1", "--max-waiting", "1")
        try:
            c = s.client()
            msgs = [{"role": "user", "content": "Write a long story."}]
            # Streaming requests are queued before the response starts.
            running = c.chat.completions.create(model=s.model, messages=msgs, max_tokens=400,
                                                stream=True, extra_body={"ignore_eos": True})
            next(iter(running))
            waiting = c.chat.completions.create(model=s.model, messages=msgs, max_tokens=400,
                                                stream=True, extra_body={"ignore_eos": True})
            code, resp, headers = s.post("/v1/chat/completions",
                                         {"model": s.model, "messages": msgs, "max_tokens": 2})
            self.assertEqual(code, 429, resp)
            self.assertEqual(resp["error"]["type"], "rate_limit_error")
            self.assertIn("retry-after", {k.lower() for k in headers})
            running.close()
            waiting.close()
        finally:
            s.stop()


class Speculation(unittest.TestCase):
    def test_lookup_drafts_serve_the_plain_greedy_answer(self):
        """`serve --lookup-depth 4`: a chat answer that repeats its prompt gets the default
        server's greedy tokens, streamed or not, and /metrics counts kept drafts."""
        msgs = [{"role": "user", "content":
                 "Repeat this list exactly: apples, pears, plums, cherries, grapes, figs, "
                 "dates, lemons, limes, melons."}]
        want = chat(msgs, max_tokens=40)
        s = Server("--lookup-depth", "4")
        try:
            c = s.client()
            got = c.chat.completions.create(model=s.model, messages=msgs, temperature=0,
                                            max_tokens=40)
            self.assertEqual(got.choices[0].message.content, want.choices[0].message.content)
            self.assertEqual(got.usage.completion_tokens, want.usage.completion_tokens)
            stream = c.chat.completions.create(model=s.model, messages=msgs, temperature=0,
                                               max_tokens=40, stream=True)
            text = "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)
            self.assertEqual(text, want.choices[0].message.content)
            metrics = s.get("/metrics")[1]
            kept = [l for l in metrics.splitlines()
                    if l.startswith("ferrite_spec_accepted_tokens_total")]
            self.assertTrue(kept and float(kept[0].split()[-1]) > 0, metrics)
        finally:
            s.stop()


class ApiKey(unittest.TestCase):
    def test_key_required_when_set(self):
        s = Server("--api-key", KEY)
        try:
            self.assertEqual(s.get("/health")[0], 200)
            self.assertEqual(s.get("/v1/models")[0], 401)
            self.assertEqual(s.get("/metrics")[0], 401)
            self.assertEqual(s.request("GET", "/v1/models", key="wrong")[0], 401)
            self.assertEqual(s.request("GET", "/v1/models", key=KEY)[0], 200)
            with self.assertRaises(openai.AuthenticationError):
                s.client("bad-key").chat.completions.create(
                    model=s.model, messages=[{"role": "user", "content": "x"}], max_tokens=2)
            r = s.client(KEY).chat.completions.create(
                model=s.model, messages=[{"role": "user", "content": "x"}], max_tokens=2)
            self.assertEqual(r.usage.completion_tokens, 2)
        finally:
            s.stop()

    def test_no_key_needed_when_unset(self):
        self.assertEqual(SERVER.get("/v1/models")[0], 200)


if __name__ == "__main__":
    if len(sys.argv) > 1 and os.path.isfile(sys.argv[1]):
        BIN = os.path.abspath(sys.argv.pop(1))
    unittest.main(verbosity=2)
