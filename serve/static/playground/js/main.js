// The playground's entry: tabs (by URL hash), the API key field, and the model list each tab draws from.
import { ApiError, apiKey, getJSON, setApiKey } from "./api.js";
import { initChat, setChatModels } from "./chat.js";
import { $, showBanner } from "./dom.js";
import { initImages, setImageModels } from "./images.js";
import { setServerModels, watchServer } from "./server.js";
import { initVideo, setVideoModels } from "./video.js";
import { initVoice, setVoiceModels } from "./voice.js";

const TABS = ["images", "chat", "voice", "video", "server"];

function showTab() {
  const wanted = location.hash.slice(1);
  const current = TABS.includes(wanted) ? wanted : TABS[0];
  for (const name of TABS) {
    const selected = name === current;
    $(`tab-${name}`).setAttribute("aria-selected", String(selected));
    $(`tab-${name}`).tabIndex = selected ? 0 : -1;
    $(`panel-${name}`).hidden = !selected;
  }
  watchServer(current === "server");
}

// Arrow keys move between tabs, as a tablist should.
function onTabKey(event) {
  const step = { ArrowRight: 1, ArrowLeft: -1 }[event.key];
  if (!step) return;
  const index = TABS.indexOf(location.hash.slice(1) || TABS[0]);
  const next = TABS[(index + step + TABS.length) % TABS.length];
  location.hash = next;
  $(`tab-${next}`).focus();
}

async function loadModels() {
  try {
    const { data } = await getJSON("/v1/models");
    const models = data.filter((m) => m.object === "model");
    showBanner("");
    $("key-form").hidden = !apiKey();
    setImageModels(models);
    setChatModels(models);
    setVoiceModels(models);
    setVideoModels(models);
    setServerModels(models);
  } catch (error) {
    if (error instanceof ApiError && error.status === 401) {
      $("key-form").hidden = false;
      showBanner(`This server needs an API key: ${error.message}`);
      $("api-key").focus();
    } else {
      showBanner(`Could not list the models: ${error.message}`);
    }
  }
}

function init() {
  $("api-key").value = apiKey();
  $("key-form").addEventListener("submit", (event) => {
    event.preventDefault();
    setApiKey($("api-key").value.trim());
    loadModels();
  });
  $("tab-images").parentElement.addEventListener("keydown", onTabKey);
  window.addEventListener("hashchange", showTab);
  initImages();
  initChat();
  initVoice();
  initVideo();
  showTab();
  loadModels();
}

init();
