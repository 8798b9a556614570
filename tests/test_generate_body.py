"""An HTTP /generate body typed and range-checked before it goes upstream (serving.request.generate_json_inputs
and parse_request, as deploy/generate_front.py runs them), without a server.

Issue 41 item 7: tritonserver 2.51 maps a /generate body onto the model's inputs by their config
types, wrapping integers to INT32 (`max_tokens` 4294967299 served as 3 tokens) and answering 500 to a
value of the wrong JSON type. Each class of value here: refused naming the field, or typed exactly.
"""
from __future__ import annotations

import json

import numpy as np
import pytest

from runtime.errors import RequestError
from serving.config_template import model_inputs
from serving.request import generate_json_inputs, parse_request

INPUTS = model_inputs()

REFUSED = {
    # integers beyond the input's width: refused, not wrapped
    "max_tokens 2**32 + 3": ({"max_tokens": 4294967299}, "max_tokens: must be a 32-bit integer"),
    "max_tokens -2**32 + 3": ({"max_tokens": -4294967293}, "max_tokens: must be a 32-bit integer"),
    "top_k 2**32 + 1": ({"top_k": 4294967297}, "top_k: must be a 32-bit integer"),
    "seed 2**63 (INT64)": ({"seed": 2 ** 63}, "seed: must be a 64-bit integer"),
    "temperature beyond FP32": ({"temperature": 1e40}, "temperature: must be a finite 32-bit float"),
    # the wrong JSON type (tritonserver: 500)
    "text_input a number": ({"text_input": 5}, "text_input: must be a string"),
    "text_input null": ({"text_input": None}, "text_input: must be a string"),
    "max_tokens 3.5": ({"max_tokens": 3.5}, "max_tokens: must be int"),
    "max_tokens true": ({"max_tokens": True}, "max_tokens: must be int"),
    "max_tokens null": ({"max_tokens": None}, "max_tokens: must be int"),
    "stream 'yes'": ({"stream": "yes"}, "stream: must be bool"),
    "stop [1, 2]": ({"stop": [1, 2]}, "stop: must be a string"),
    "sampling_parameters an object": ({"sampling_parameters": {"n": 2}}, "sampling_parameters: must be a string"),
    "a lone surrogate": ({"text_input": "\ud800"}, "text_input: holds a lone UTF-16 surrogate"),
    "a parameter that is an array": ({"n": [2]}, "parameters.n: must be a number, boolean or string"),
    # values the model refuses: refused here already, by the same checks
    "max_tokens 0": ({"max_tokens": 0}, "max_tokens: must be a positive integer"),
    "unknown parameter": ({"bogus": 1}, "parameters.bogus: is not a known sampling parameter"),
    "n 17 in sampling_parameters": ({"sampling_parameters": json.dumps({"n": 17})}, "sampling_parameters.n: "),
    "two prompts": ({"text_input": ["a", "b"]}, "text_input: must hold exactly one prompt"),
}


def check(body: dict):
    inputs, parameters = generate_json_inputs({"text_input": "hi", **body}, INPUTS)
    return inputs, parameters, parse_request(inputs.get, parameters)


@pytest.mark.parametrize("name", REFUSED)
def test_a_bad_field_is_refused_naming_it(name):
    body, message = REFUSED[name]
    with pytest.raises(RequestError) as err:
        check(body)
    assert str(err.value).startswith(message) and "\n" not in str(err.value), str(err.value)


def test_a_body_that_is_not_an_object_is_refused():
    with pytest.raises(RequestError, match="^body: must be a JSON object"):
        generate_json_inputs([], INPUTS)


def test_values_get_their_inputs_types_and_the_rest_are_parameters():
    inputs, parameters, req = check({"max_tokens": "5", "top_k": 2 ** 31 - 1, "seed": -(2 ** 63), "temperature": 0.5,
                                     "stream": True, "stop": "\n", "n": 2, "triton_enable_empty_final_response": True})
    # "5" is read as 5, as inside sampling_parameters
    assert inputs["max_tokens"].dtype == np.int32 and inputs["max_tokens"].tolist() == [5]
    assert inputs["top_k"].tolist() == [2 ** 31 - 1] and inputs["seed"].dtype == np.int64
    assert inputs["temperature"].dtype == np.float32 and inputs["stream"].dtype == np.bool_
    assert inputs["text_input"].tolist() == [b"hi"] and inputs["stop"].tolist() == [b"\n"]
    assert parameters == {"n": 2, "triton_enable_empty_final_response": True}
    assert req.params.max_tokens == 5 and req.params.n == 2 and req.stream


def test_the_input_types_are_the_model_configs():
    assert INPUTS["text_input"] == "TYPE_STRING" and INPUTS["max_tokens"] == "TYPE_INT32"
    assert INPUTS["seed"] == "TYPE_INT64" and INPUTS["temperature"] == "TYPE_FP32" and len(INPUTS) == 11
