// A Node.js client of the nemo-gym-grpc contract, for tests/test_node_client.py.
//
// Loads nemo_gym_grpc/v1/verify.proto at run time with @grpc/proto-loader (no generated
// code), calls ListResourcesServers, Verify and VerifyStream on a running bridge, decodes
// each per-item google.rpc.Status's ErrorInfo detail with protobufjs, and prints what it got
// as one JSON object on stdout.
//
// Usage: node conformance.js INPUT.json
//   INPUT.json: {"target": "host:port", "includeDirs": [dir with nemo_gym_grpc/v1/verify.proto,
//                dir with google/rpc/status.proto], "unary": VerifyRequest,
//                "stream": [[VerifyRequest, ...], ...]  (one list per VerifyStreamRequest)}
// Requires @grpc/grpc-js and @grpc/proto-loader (NODE_PATH or a node_modules beside it).

"use strict";

const fs = require("fs");
const grpc = require("@grpc/grpc-js");
const protoLoader = require("@grpc/proto-loader");
const protobuf = require("protobufjs");

const input = JSON.parse(fs.readFileSync(process.argv[2], "utf8"));
const options = {
  keepCase: true, // field names as in the .proto (request_id, reward_components, ...)
  longs: String,
  enums: String,
  defaults: true,
  oneofs: true,
  includeDirs: input.includeDirs,
};
const definition = protoLoader.loadSync("nemo_gym_grpc/v1/verify.proto", options);
const VerifyService = grpc.loadPackageDefinition(definition).nemo_gym_grpc.v1.VerifyService;
const client = new VerifyService(input.target, grpc.credentials.createInsecure(), {
  "grpc.max_receive_message_length": 64 * 1024 * 1024,
  "grpc.max_send_message_length": 64 * 1024 * 1024,
});

// google.rpc.ErrorInfo, to read the reason out of each error's `details` (google.protobuf.Any).
const root = new protobuf.Root();
root.resolvePath = (_origin, target) => {
  for (const dir of input.includeDirs) {
    const path = `${dir}/${target}`;
    if (fs.existsSync(path)) return path;
  }
  return target;
};
root.loadSync("google/rpc/error_details.proto");
const ErrorInfo = root.lookupType("google.rpc.ErrorInfo");

function summarize(result) {
  const out = {
    request_id: result.request_id,
    outcome: result.outcome, // which member of the `outcome` oneof is set: "reward" or "error"
    reward: result.reward,
    reward_components: result.reward_components,
    latency_seconds: result.latency_seconds,
    error: null,
  };
  if (result.error) {
    out.error = { code: result.error.code, message: result.error.message, reasons: [] };
    for (const detail of result.error.details) {
      if (detail.type_url.endsWith("/google.rpc.ErrorInfo")) {
        out.error.reasons.push(ErrorInfo.decode(detail.value).reason);
      }
    }
  }
  return out;
}

function deadline() {
  return new Date(Date.now() + 60000);
}

function list() {
  return new Promise((resolve, reject) => {
    client.ListResourcesServers({}, { deadline: deadline() }, (err, reply) =>
      err ? reject(err) : resolve(reply.resources_servers.map((s) => s.name)),
    );
  });
}

function verify(item) {
  return new Promise((resolve, reject) => {
    client.Verify(item, { deadline: deadline() }, (err, reply) =>
      err ? reject(err) : resolve(summarize(reply)),
    );
  });
}

function verifyStream(batches) {
  return new Promise((resolve, reject) => {
    const results = [];
    let messages = 0;
    const call = client.VerifyStream({ deadline: deadline() });
    call.on("data", (message) => {
      messages += 1;
      for (const result of message.results) results.push(summarize(result));
    });
    call.on("error", reject);
    call.on("end", () => resolve({ results, messages }));
    for (const items of batches) call.write({ items });
    call.end(); // half-close: the bridge finishes what it holds, then ends with OK
  });
}

async function main() {
  const servers = await list();
  const unary = await verify(input.unary);
  const stream = await verifyStream(input.stream);
  process.stdout.write(JSON.stringify({ servers, unary, stream }) + "\n");
  client.close();
}

main().catch((err) => {
  process.stderr.write(`conformance client failed: ${err.stack || err}\n`);
  process.exit(1);
});
