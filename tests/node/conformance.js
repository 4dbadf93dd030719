// A Node.js client of the nemo-gym-grpc contract, for tests/test_node_client.py.
//
// Loads nemo_gym_grpc/v1/verify.proto at run time with @grpc/proto-loader (no generated
// code), calls ListResourcesServers, Verify and VerifyStream on a running bridge, decodes
// each per-item google.rpc.Status's ErrorInfo detail (reason, domain, metadata) with
// protobufjs, and prints what it got as one JSON object on stdout.
//
// Usage: node conformance.js INPUT.json
//   INPUT.json: {"target": "host:port", "includeDirs": [dir with nemo_gym_grpc/v1/verify.proto,
//                dir with google/rpc/status.proto], "unary": VerifyRequest,
//                "stream": [[VerifyRequest, ...], ...]  (one list per VerifyStreamRequest)}
// Requires @grpc/grpc-js, @grpc/proto-loader and protobufjs (NODE_PATH or a node_modules
// beside it).

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

// google.rpc.ErrorInfo (reason, domain, metadata), to decode each error's `details`
// (google.protobuf.Any) the way docs/clients.md shows. protobufjs comes with
// @grpc/proto-loader; it resolves error_details.proto's google/protobuf imports itself.
const gapi = input.includeDirs.find((dir) =>
  fs.existsSync(`${dir}/google/rpc/error_details.proto`),
);
const ErrorInfo = protobuf
  .loadSync(`${gapi}/google/rpc/error_details.proto`)
  .lookupType("google.rpc.ErrorInfo");

// The ErrorInfo of a per-item google.rpc.Status (VerifyResponse.error), or null.
function errorInfo(status) {
  const detail = status.details.find((d) => d.type_url.endsWith("/google.rpc.ErrorInfo"));
  return detail ? ErrorInfo.toObject(ErrorInfo.decode(detail.value), { defaults: true }) : null;
}

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
    out.error = {
      code: result.error.code,
      message: result.error.message,
      reasons: result.error.details
        .filter((d) => d.type_url.endsWith("/google.rpc.ErrorInfo"))
        .map((d) => ErrorInfo.decode(d.value).reason),
      info: errorInfo(result.error),
    };
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
